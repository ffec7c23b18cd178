"""Backups of a training run: the `BackupAndRestore` callback and what it stands on.

- `callback.py`: `BackupAndRestore` (``sg.callbacks.BackupAndRestore``): restore at the start, save every
  `save_freq` steps or epoch, keep the previous backup, delete them at the end.
- `claim.py`: one job per backup directory (a claim file naming the job; a second job is refused).
- `directory.py`: the checks of a backup directory (a folder stratagem may write, room for two backups).
- `writer.py`: a single-file backup written on a thread from a snapshot of the state.
- `sharded.py`: under a sharded strategy, a directory of every rank's shards with a manifest of digests written
  last (`torch.distributed.checkpoint`).
- `report.py`: what a backup directory holds, for `stratagem checkpoint inspect | verify | export`.
"""
