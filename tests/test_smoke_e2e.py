from tests.procs import ProcessPool, worker_records


def test_smoke(procs: ProcessPool) -> None:
    lh = procs.lighthouse({"lr": 0.001, "name": "run"})
    m = procs.manager(lh.address, "g0")
    w = procs.worker(m.address, group="g0", rank=0, steps=5)
    recs = worker_records(w)
    assert [r["config"] for r in recs] == [{"lr": "0.001", "name": "run"}] * 5
