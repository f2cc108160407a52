"""Following a real API server: credentials (client.py), list/watch (source.py, reflector.py) and
Kubernetes Events about malformed objects (events.py). Effects: the pure layers never import this.

Nothing is re-exported here, so importing one module of the package does not pull in the
kubernetes client (half a second of imports) where it is not needed.
"""
