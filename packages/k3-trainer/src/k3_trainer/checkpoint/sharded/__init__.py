"""Sharded checkpoints: a ``torch.distributed.checkpoint`` folder under the format-7 gate.

Under FSDP2 no rank holds the whole state, and gathering it onto one would cap the model
at one host's memory. Every rank writes its own part of every component with
``torch.distributed.checkpoint`` (DCP): the weights and optimizer state keyed by parameter
name and global shape, so any world size can read them back (DCP reshards), and every other
component's ``state_dict()`` under its own name (a group nested under the group's name),
plain values and tensors alike. A sharded tensor (a DTensor, e.g. a stateful callback's
moving average of FSDP2 weights) is written by the ranks that hold its shards and never
gathered onto one. Beside the shards, rank 0 writes ``k3.ckpt``: an ordinary format-7
checkpoint of the metadata the compatibility policy compares, the runtime signature and
the RNG, whose one component ``shards`` is the index of the folder: every shard file's size
and XXH3-128 checksum (``k3_checkpoint.file_checksum``), the names of the components in the
shards, each optimizer's class and layout (global shapes, so any world size compares equal)
and the shape of every other component's state (where its tensors are; DCP itself keeps no
trace of an empty mapping). The folder, named and published by the caller::

    <step folder>/
        .metadata  __0_0.distcp  __1_0.distcp  k3.ckpt

The modules, one concept each: :mod:`.folder` (what the folder holds on disk: ``k3.ckpt``
beside DCP's files, each file's size and checksum), :mod:`.write` (a write on the calling
thread), :mod:`.background` (a write off the training path), :mod:`.read` (a load),
:mod:`.check` (the index and what a load checks before it changes anything),
:mod:`.summary` (``k3-train inspect``), :mod:`.dcp` (the DCP plumbing they share) and
:mod:`.tree` (the nested states and their skeletons).
"""

from .async_save import ShardedWrite, start_sharded_write
from .check import ShardIndex, check_tensor_table
from .folder import META, is_sharded
from .read import read_sharded
from .summary import describe_sharded
from .write import reshard, write_sharded

__all__ = [
    "META",
    "ShardIndex",
    "ShardedWrite",
    "check_tensor_table",
    "describe_sharded",
    "is_sharded",
    "read_sharded",
    "reshard",
    "start_sharded_write",
    "write_sharded",
]
