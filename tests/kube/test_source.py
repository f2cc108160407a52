"""ApiSource against the fake API server: the initial list, the watch, selectors, the Node.

Each test names the kube-proxy behaviour it stands for.
"""

from __future__ import annotations

from agent.kube.resources import SERVICE_FIELD_SELECTOR, SERVICE_LABEL_SELECTOR, SLICE_LABEL_SELECTOR
from agent.sources.base import EventType, Kind, ObjectEvent, Synced
from lab.fakeapi import FakeApiServer
from lab.fakeapi.objects import endpoint_slice, node, service
from tests.kube.conftest import SourceFactory


def svc(name: str, ip: str, ns: str = "default", **labels: str) -> dict[str, object]:
    return service(name, ip, namespace=ns, labels=labels or None)


def test_initial_list_across_pages_delivers_everything_then_synced(
    paging_server: FakeApiServer, start_source: SourceFactory
) -> None:
    server = paging_server
    # kube-proxy waits for its informers' initial list (HasSynced) before the first sync.
    for i in range(10):  # page size 3: four pages
        server.create(svc(f"web-{i}", f"10.96.0.{i + 1}"))
        server.create(endpoint_slice(f"web-{i}", [f"10.244.1.{i + 1}"]))
    source, sink = start_source(server)
    sink.wait(
        lambda: bool(sink.synced(Kind.SERVICE) and sink.synced(Kind.ENDPOINT_SLICE)), what="both Synced"
    )

    services = sink.objects(Kind.SERVICE)
    assert [e.key for e in services] == [f"default/web-{i}" for i in range(10)]
    assert all(e.type is EventType.ADDED for e in services)
    # Synced comes after the last object of its kind, with the list's resourceVersion.
    events = sink.events
    last_service = max(
        i for i, e in enumerate(events) if isinstance(e, ObjectEvent) and e.kind is Kind.SERVICE
    )
    synced_at = events.index(sink.synced(Kind.SERVICE)[0])
    assert synced_at > last_service
    assert sink.synced(Kind.SERVICE)[0].version == server.resource_version
    assert len(sink.objects(Kind.ENDPOINT_SLICE)) == 10
    # List items arrive without kind/apiVersion (as kube-apiserver sends them); the source fills them.
    assert services[0].obj["kind"] == "Service" and services[0].obj["apiVersion"] == "v1"
    slice_obj = sink.objects(Kind.ENDPOINT_SLICE)[0].obj
    assert slice_obj["apiVersion"] == "discovery.k8s.io/v1"
    assert "managedFields" not in slice_obj["metadata"], "stripped: never read, often the bulk"
    # Really paginated: four list requests with limit=3 for Services, continue tokens after the first.
    lists = [r for r in server.requests if r.path == "/api/v1/services" and r.query.get("watch") != "true"]
    assert [r.query.get("limit") for r in lists] == ["3"] * 4
    assert "continue" not in lists[0].query and all("continue" in r.query for r in lists[1:])
    # client-go's pager: resourceVersion=0 on the first request only (the snapshot is the token's).
    assert lists[0].query.get("resourceVersion") == "0"
    assert all("resourceVersion" not in r.query for r in lists[1:])
    assert source.list_counts()[Kind.SERVICE] == 1


def test_first_list_is_one_request_from_the_watch_cache(
    server: FakeApiServer, start_source: SourceFactory
) -> None:
    # client-go's reflector lists first at resourceVersion=0, which kube-apiserver answers from its
    # watch cache, whole, ignoring the limit: one request, however many objects (and so one token
    # of the client's rate limit, not one a page). The items still reach the sink a page at a time.
    for i in range(10):
        server.create(svc(f"web-{i}", f"10.96.0.{i + 1}"))
    source, sink = start_source(server)
    sink.wait(lambda: bool(sink.synced(Kind.SERVICE)), what="Services synced")
    lists = [r for r in server.requests if r.path == "/api/v1/services" and r.query.get("watch") != "true"]
    assert len(lists) == 1
    assert lists[0].query.get("resourceVersion") == "0" and lists[0].query.get("limit") == "3"
    batches = [kept for b in sink.batches if (kept := [e for e in b if e.kind is Kind.SERVICE])]
    sizes = [sum(isinstance(e, ObjectEvent) for e in b) for b in batches]
    assert sizes == [3, 3, 3, 1], "delivered page_size at a time"
    assert isinstance(batches[-1][-1], Synced) and batches[-1][-1].version == server.resource_version
    assert [e.key for e in sink.objects(Kind.SERVICE)] == [f"default/web-{i}" for i in range(10)]
    assert source.list_counts()[Kind.SERVICE] == 1


def test_watch_delivers_adds_changes_deletes_in_order(
    server: FakeApiServer, start_source: SourceFactory
) -> None:
    server.create(svc("a", "10.96.0.1"))
    _, sink = start_source(server)
    sink.wait(lambda: bool(sink.synced(Kind.SERVICE)))
    mark = sink.mark()

    server.create(svc("b", "10.96.0.2"))
    changed = svc("a", "10.96.0.1")
    changed["spec"]["ports"] = [{"name": "http", "port": 81, "protocol": "TCP", "targetPort": 8080}]  # type: ignore[index]
    server.update(changed)
    server.delete("Service", "default", "b")
    server.create(svc("c", "10.96.0.3"))

    def got() -> list[tuple[EventType, str]]:
        return [(e.type, e.key) for e in sink.since(mark) if isinstance(e, ObjectEvent)]

    expected = [
        (EventType.ADDED, "default/b"),
        (EventType.MODIFIED, "default/a"),
        (EventType.DELETED, "default/b"),
        (EventType.ADDED, "default/c"),
    ]
    sink.wait(lambda: len(got()) >= 4, what="four watch events")
    assert got() == expected
    modified = [e for e in sink.since(mark) if isinstance(e, ObjectEvent) and e.type is EventType.MODIFIED]
    assert modified[0].obj["spec"]["ports"][0]["port"] == 81
    assert sink.state(Kind.SERVICE).keys() == {"default/a", "default/c"}


def test_selectors_per_kind_as_kube_proxys_informers(
    server: FakeApiServer, start_source: SourceFactory
) -> None:
    # kube-proxy: Services `!service-proxy-name` + `spec.clusterIP!=None`, EndpointSlices `!headless`.
    proxy_name, headless = "service.kubernetes.io/service-proxy-name", "service.kubernetes.io/headless"
    server.create(svc("plain", "10.96.0.1"))
    server.create(svc("other-proxy", "10.96.0.2", **{proxy_name: "cilium"}))
    server.create(svc("dns-only", "None"))
    server.create(svc("labelled-headless", "10.96.0.3", **{headless: ""}))
    server.create(endpoint_slice("plain", ["10.244.1.1"]))
    server.create(endpoint_slice("db", ["10.244.1.2"], labels={headless: ""}))
    server.create(endpoint_slice("mirror", ["10.244.1.3"], labels={proxy_name: "cilium"}))
    _, sink = start_source(server)
    sink.wait(lambda: bool(sink.synced(Kind.SERVICE) and sink.synced(Kind.ENDPOINT_SLICE)))
    assert sink.state(Kind.SERVICE).keys() == {"default/plain", "default/labelled-headless"}
    assert sink.state(Kind.ENDPOINT_SLICE).keys() == {"default/plain-abcde", "default/mirror-abcde"}
    sent = {
        (r.path, r.query.get("labelSelector"), r.query.get("fieldSelector"))
        for r in server.requests
        if r.path in ("/api/v1/services", "/apis/discovery.k8s.io/v1/endpointslices")
    }
    assert sent == {
        ("/api/v1/services", SERVICE_LABEL_SELECTOR, SERVICE_FIELD_SELECTOR),
        ("/apis/discovery.k8s.io/v1/endpointslices", SLICE_LABEL_SELECTOR, None),
    }
    assert SERVICE_FIELD_SELECTOR == "spec.clusterIP!=None"

    # A Service that takes the label on leaves the selector: the watch says DELETED (cacher
    # semantics); one that drops it comes back as ADDED.
    mark = sink.mark()
    server.apply(svc("plain", "10.96.0.1", **{proxy_name: "cilium"}))
    server.apply(svc("other-proxy", "10.96.0.2"))
    sink.wait(lambda: len(sink.since(mark)) >= 2)
    assert [(e.type, e.key) for e in sink.since(mark) if isinstance(e, ObjectEvent)] == [
        (EventType.DELETED, "default/plain"),
        (EventType.ADDED, "default/other-proxy"),
    ]


def test_node_watch_sees_only_this_node(server: FakeApiServer, start_source: SourceFactory) -> None:
    # kube-proxy's node informer: fieldSelector metadata.name=<hostname>.
    server.create(node("node1", "192.168.0.11"))
    server.create(node("node2", "192.168.0.12"))
    _, sink = start_source(server, hostname="node1")
    sink.wait(lambda: bool(sink.synced(Kind.NODE)))
    assert [(e.type, e.key) for e in sink.objects(Kind.NODE)] == [(EventType.ADDED, "node1")]
    mark = sink.mark()

    server.apply(node("node2", "192.168.0.99"))
    marked = node("node1", "192.168.0.11", zone="zone-b", deletionTimestamp="2026-01-01T00:00:00Z")
    server.apply(marked)
    sink.wait(lambda: any(isinstance(e, ObjectEvent) for e in sink.since(mark)))
    node_events = [e for e in sink.since(mark) if isinstance(e, ObjectEvent)]
    assert [(e.type, e.key) for e in node_events] == [(EventType.MODIFIED, "node1")]
    obj = node_events[0].obj
    assert obj["metadata"]["labels"]["topology.kubernetes.io/zone"] == "zone-b"
    assert obj["metadata"]["deletionTimestamp"] == "2026-01-01T00:00:00Z"
    assert obj["status"]["addresses"][0]["address"] == "192.168.0.11"
    node_requests = [r for r in server.requests if r.path == "/api/v1/nodes"]
    assert node_requests and {r.query.get("fieldSelector") for r in node_requests} == {"metadata.name=node1"}


def test_node_not_registered_yet_still_synces(server: FakeApiServer, start_source: SourceFactory) -> None:
    # The first-sync gate must not hang when the Node object does not exist yet; it comes later.
    source, sink = start_source(server, hostname="node1")
    assert source.kinds == {Kind.SERVICE, Kind.ENDPOINT_SLICE, Kind.NODE}
    sink.wait(lambda: bool(sink.synced(Kind.NODE)))
    assert sink.objects(Kind.NODE) == []
    server.create(node("node1"))
    sink.wait(lambda: bool(sink.objects(Kind.NODE)))
    assert sink.objects(Kind.NODE)[0].type is EventType.ADDED


def test_without_hostname_no_node_watch(server: FakeApiServer, start_source: SourceFactory) -> None:
    source, sink = start_source(server, hostname="")
    assert source.kinds == {Kind.SERVICE, Kind.ENDPOINT_SLICE}
    sink.wait(lambda: bool(sink.synced(Kind.SERVICE) and sink.synced(Kind.ENDPOINT_SLICE)))
    paths = {r.path for r in server.requests}
    assert "/api/v1/services" in paths, paths  # the request log holds what was asked
    assert "/api/v1/nodes" not in paths, paths


def test_each_kind_gets_its_own_synced_and_watch(server: FakeApiServer, start_source: SourceFactory) -> None:
    _, sink = start_source(server)
    sink.wait(lambda: all(sink.synced(k) for k in (Kind.SERVICE, Kind.ENDPOINT_SLICE, Kind.NODE)))
    # Every kind watches with bookmarks, from the list's resourceVersion.
    sink.wait(lambda: server.open_streams() == 3, what="three open watches")
    watches = [r for r in server.requests if r.query.get("watch") == "true"]
    assert {r.path for r in watches} == {
        "/api/v1/services",
        "/apis/discovery.k8s.io/v1/endpointslices",
        "/api/v1/nodes",
    }
    assert all(r.query.get("allowWatchBookmarks") == "true" for r in watches)
    assert all(r.query.get("resourceVersion") == server.resource_version for r in watches)
    assert all(30 <= int(r.query["timeoutSeconds"]) <= 40 for r in watches)
    assert all(isinstance(e, Synced) for e in sink.events)  # an empty cluster: only the marks
