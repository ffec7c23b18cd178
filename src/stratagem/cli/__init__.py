"""The ``stratagem`` command. Only this package prints."""
