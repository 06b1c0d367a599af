"""The web page of a server or a gossip peer (dashboard.py and its static files); it imports no
server or peer internals: each side hands it a source of runs and nodes."""
