from stratagem.cli.main import main

raise SystemExit(main())
