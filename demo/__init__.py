"""``kvtier demo`` (``make run``): a small cluster on this machine showing a miss, a GPU hit,
a node-DRAM hit and a remote hit (``cluster``), and a minimal pool client (``pool_client``)."""
