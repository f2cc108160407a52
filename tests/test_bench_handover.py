"""bench.handover at a small scale: both hand-overs give back the records read in place."""

from __future__ import annotations

from bench import handover


def test_a_small_hand_over_rebuilds_every_record() -> None:
    out = handover.run(40, 3)
    assert all(out[piece] >= 0 for piece in ("decode", "parse", "marshal pack", "marshal unpack"))
    assert 0 < out["marshal MB"] < out["pickle MB"] * 2


def test_a_refused_slice_goes_over_with_its_error() -> None:
    """A malformed slice (an endpoint without addresses) keeps its error through the hand-over: the
    model would report it as it does today."""
    import orjson

    from lab.fakeapi.objects import scale_objects

    slices = [o for o in scale_objects(2, 2) if o["kind"] == "EndpointSlice"]
    slices[0]["endpoints"][0].pop("addresses")
    reads, _, _ = handover.read_all([orjson.dumps(o) for o in slices])
    assert reads[0].record.error
    back = handover.unpack(handover.pack(reads))
    assert [b.record for b in back] == [r.record for r in reads]
    assert back[0].record.error == reads[0].record.error
