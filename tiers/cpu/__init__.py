"""The CPU tier: a node-shared DRAM pool in POSIX shared memory."""
