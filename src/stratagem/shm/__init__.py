"""Shared memory between the processes of one host: the one measured exception to "collectives go
through ``torch.distributed``, the parameter server speaks gRPC".

Gloo over loopback and gRPC's messages cost several memory copies and a few thread wake-ups per
message; processes of one host can hand each other CPU tensors through one mapped file instead.
Two transports do, over shared pieces:

- ``sums``: the sums of MultiWorkerMirrored workers that all run on this host (used by
  ``collective.cross_worker`` in place of Gloo's all-reduce for CPU tensors), and over the same
  file the all-gathers and reduce-scatters of ShardedStrategy's units (``strategies.sharded.transport``);
- ``parameter_server``: pulls and pushes between a worker and a parameter server on one host (used
  by ``strategies.parameter_server`` in place of gRPC messages);
- ``files``: the files in ``/dev/shm`` (space reserved, mode 0600, a random name that carries the
  maker's pid and start time, a nonce checked on mapping, unlinked once mapped, files of dead
  makers cleaned up) and how a process tells another apart (host identity, process start time);
- ``counters``: counters in a mapping that tell another process its data is ready, and sleeping on
  them with futex(2) through ctypes, every wait bounded;
- ``eligibility``: whether this process may take part at all: the switch
  ``STRATAGEM_SHARED_MEMORY=0`` (read by ``stratagem.environ``), Linux, x86-64 where counters order
  data, a ``/dev/shm`` this user can write.

What they rely on: Linux (``/proc``, futex(2), a tmpfs ``/dev/shm`` with room for the file), x86-64's
total store order (a counter stored after the data is seen after it, with no fence), every party on
the same host under the same user. Where any of it is missing, or the switch is off, the users fall
back (MultiWorkerMirrored to Gloo, the parameter server to gRPC) and ``explain()`` says why;
``docs/shared_memory.md`` is the user's page.
"""
