"""Where trials run: device inventory, sizing, packing, leases and the scheduling policy.

Pure logic (packing, policy) has no I/O; inventory and leases hold all of it.
"""
