"""The backends: one module per way of moving bytes (``reference``, ``pipelined``, ``symm``,
``torch_symm_mem``), what they share (``base``, ``schedule``, ``scaled``), and ``choice``: which
of them runs a call, the names a user asks for them by and the settings that ask.
"""
