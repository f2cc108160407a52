"""A fake kube-apiserver for tests: real HTTP, kube-apiserver's paths, JSON and watch semantics.

`FakeApiServer` (server.py) is the entry point; see its module docstring for what it implements
and what it simplifies. `objects.py` builds the Services, EndpointSlices and Nodes tests create.
"""

from lab.fakeapi.server import FakeApiServer, Request, status

__all__ = ["FakeApiServer", "Request", "status"]
