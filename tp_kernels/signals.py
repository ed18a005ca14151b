"""The values of the ``symm`` signal protocol, shared by the Triton kernels and the host-side
copier and pusher (this module imports nothing, so the host side needs no Triton).

Every word the protocol waits on goes ``0 -> RAISED -> 0`` (see :mod:`tp_kernels.kernels`): no
value depends on the call, so a CUDA graph replays the same words correctly. A wait past its
deadline records which wait it was, as one of the ``WAIT_*`` codes, in the kernels' timeout
status.
"""

RAISED = 1

WAIT_START = 1
WAIT_PUBLISHED = 2
WAIT_CHUNK = 3
WAIT_SLOT = 4

WAIT_NAMES = {
    WAIT_START: "its arrival at the call's start barrier (it has not finished its previous call)",
    WAIT_PUBLISHED: "its shard's publication (the publish barrier)",
    WAIT_CHUNK: "a chunk of its shard copied into this rank's gathered A (a progress word)",
    WAIT_SLOT: "its partial pushed into this rank's slot (a slot word)",
}
