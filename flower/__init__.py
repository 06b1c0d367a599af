"""shoal on Flower (an optional extra: ``pip install 'shoal[flower]'``).

``apps``: ShoalStrategy (shoal's rounds and aggregation inside a Flower ServerApp) and the
ClientApp around shoal's trainer; ``engine``: ``simulation.engine = "flower"``, the same
experiment on Flower's Ray-backed simulation runtime.
"""
