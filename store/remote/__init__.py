"""The store's side of the remote tier: serving its pool to peers' transfer engines, pulling
runs of chunks from peers (``fetch``), and demoting cold chunks to peers with room."""
