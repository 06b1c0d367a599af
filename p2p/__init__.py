"""The gossip peer: membership, peer sampling, exchange, merge rules."""
