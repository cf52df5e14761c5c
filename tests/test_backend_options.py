"""The backends' options come from the engine's registry, which declares
each once: gmp.backend_options shows them, and MemPool checks against them."""

from __future__ import annotations

import pytest

import gpumempool as gmp


def test_every_backend_has_its_options() -> None:
    assert set(gmp.backends()) == {"sim", "callback", "cuda", "async", "vmm", "nccl", "host"}
    for backend in gmp.backends():
        for option in gmp.backend_options(backend):
            assert option["doc"], (backend, option["name"])
            assert option["type"] in {"bool", "int", "path", "string", "device", "devices", "probability"}
            if option["type"] == "int":
                assert option["min"] <= 0 < option["max"]
    sim = {o["name"]: o for o in gmp.backend_options("sim")}
    assert sim["capacity"]["default"] == "80.00 GiB"
    assert sim["capacity"]["zero_is_default"] is True
    assert sim["capacity"]["max"] == (1 << 64) - 1
    assert sim["fail_rate"]["type"] == "probability"
    assert [o["name"] for o in gmp.backend_options("cuda")] == ["libcuda"]
    assert {o["name"]: o["type"] for o in gmp.backend_options("host")} == {
        "libcuda": "path", "host_flags": "int", "host_device": "device"}


def test_unknown_backend() -> None:
    with pytest.raises(gmp.InvalidArgumentError, match="valid backends: async, callback, cuda, host, nccl, sim, vmm"):
        gmp.backend_options("cuda9")


@pytest.mark.parametrize(
    ("backend", "options", "error", "match"),
    [
        ("vmm", {"numa_node": "0"}, TypeError, "numa_node must be an int"),
        ("vmm", {"numa_node": 1 << 31}, gmp.InvalidArgumentError, r"numa_node must be in \[0, 2147483648\)"),
        ("vmm", {"access_devices": "cuda:0"}, TypeError, "access_devices must be a list of device indices"),
        ("async", {"ipc": 1}, TypeError, "ipc must be a bool"),
        ("cuda", {"libcuda": 5}, TypeError, "libcuda must be a str"),
        ("host", {"host_device": "cpu"}, gmp.InvalidArgumentError, "device must be an int or 'cuda:N'"),
        ("sim", {"seed": 1 << 63}, gmp.InvalidArgumentError, r"seed must be in \[-9223372036854775808, "),
        ("callback", {"alignment": 1 << 31}, gmp.InvalidArgumentError, r"alignment must be in \[0, 2147483648\)"),
    ],
)
def test_options_are_checked_by_their_schema_type(backend: str, options: dict, error: type, match: str) -> None:
    kwargs = {"alloc": lambda *a: None, "free": lambda *a: None} if backend == "callback" else {}
    with pytest.raises(error, match=match):
        gmp.MemPool(backend, **kwargs, **options)


def test_device_bound_is_the_engines() -> None:
    from gpumempool._args import MAX_DEVICE as MAX_DEVICES

    assert MAX_DEVICES == 1024
    with gmp.MemPool("sim") as pool:
        with pytest.raises(gmp.InvalidArgumentError, match=r"device must be in \[0, 1024\)"):
            pool.alloc(512, device=MAX_DEVICES)
