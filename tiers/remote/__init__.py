"""The remote tier: node stores read each other's pools over the Mooncake transfer engine.

``config`` (the ``[store.remote]`` settings), ``transport`` (the data-plane interface) with
``mooncake`` (its implementation, imported lazily), ``fetch`` (pull protocol), ``demotion``
(cold chunks to peers with room), ``peers`` (control clients of peer stores), ``tier`` (the
bundle a ``NodeStore`` owns). See docs/remote.md.
"""
