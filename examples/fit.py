"""`sg.fit`: one high-level loop for every strategy, with metrics, validation and backups.

    python examples/fit.py mirrored            # or one_device, central_storage, model_parallel
    stratagem launch --workers 2 examples/fit.py multi_worker

If the run is killed, running the same command again resumes from the last backup (mid-epoch
included); the backup is removed when training finishes.
"""

import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from toy import make_loader, make_net

import stratagem as sg

STRATEGIES = {
    "one_device": lambda: sg.OneDeviceStrategy("cpu"),
    "mirrored": lambda: sg.MirroredStrategy(["cpu:0", "cpu:1"]),
    "central_storage": lambda: sg.CentralStorageStrategy(["cpu:0", "cpu:1"]),
    "model_parallel": lambda: sg.ModelParallelStrategy(stages=["cpu:0", "cpu:1"], num_micro_batches=2),
    "multi_worker": lambda: sg.MultiWorkerMirroredStrategy(timeout=60),
}
strategy = STRATEGIES[sys.argv[1] if len(sys.argv) > 1 else "mirrored"]()

net = make_net()
backup = sg.callbacks.BackupAndRestore(Path(tempfile.gettempdir()) / "stratagem-example-fit", save_freq=4)
history = sg.fit(strategy, net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9), F.cross_entropy,
                 make_loader(), epochs=5, validation_data=make_loader(batch_size=256),
                 metrics=["accuracy"], callbacks=[backup], clip_grad_norm=1.0, verbose=True)

if sg.train.is_chief(strategy):        # verbose=True printed a line per epoch; history has them all
    print(f"losses {[round(loss, 4) for loss in history.history['loss']]}, "
          f"final validation accuracy {history.history['val_accuracy'][-1]:.3f}")
strategy.close()
