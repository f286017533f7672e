"""The upload store's ledger, its routes, and the files input check (bragkit/serving/uploads.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from app_server import call_asgi

from bragkit.serving import uploads
from bragkit.serving.uploads import Proxies, UploadLedger, UploadRoutes, check_file_data, disk_charge

MB = 1_000_000


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def stored(folder: Path, name: str, size: int) -> str:
    path = folder / name
    path.write_bytes(b"x" * size)
    return str(path)


def test_a_caller_holds_at_most_its_share_and_the_store_its_budget(tmp_path):
    ledger = UploadLedger(store_bytes=10 * MB, per_caller_bytes=4 * MB, ttl=600, clock=Clock())
    assert ledger.admit("a", 3 * MB) == (200, None)
    ledger.settle("a", 3 * MB, [stored(tmp_path, "a1", 3 * MB)])
    status, why = ledger.admit("a", 2 * MB)
    assert status == 429 and "BRAG_MAX_UPLOAD_BYTES_PER_CALLER" in why and "3.0 MB" in why
    # Room reserved by an upload in flight counts too, before it is settled.
    assert ledger.admit("b", 4 * MB) == (200, None)
    assert ledger.admit("b", 1)[0] == 429
    ledger.settle("b", 4 * MB - 8192, [stored(tmp_path, "b1", 4 * MB - 8192)])
    assert ledger.admit("c", 4 * MB) == (503, "Busy: too many uploaded files are waiting; retry in a minute.")
    # Each is charged what it takes on disk: its blocks, and one for its folder.
    assert ledger.held("a") == disk_charge(3 * MB)
    assert ledger.total() == disk_charge(3 * MB) + disk_charge(4 * MB - 8192)


def test_a_read_upload_frees_its_room_and_an_old_one_is_deleted(tmp_path):
    clock = Clock()
    ledger = UploadLedger(store_bytes=10 * MB, per_caller_bytes=5 * MB, ttl=600, clock=clock)
    first, second = stored(tmp_path, "first", 2 * MB), stored(tmp_path, "second", 2 * MB)
    ledger.admit("a", 2 * MB)
    ledger.settle("a", 2 * MB, [first])
    clock.now += 300
    ledger.admit("a", 2 * MB)
    ledger.settle("a", 2 * MB, [second])
    assert ledger.holds(first) and ledger.admit("a", MB)[0] == 429
    ledger.release(second)  # a request read it: it goes
    assert ledger.held("a") == disk_charge(2 * MB) and not Path(second).exists() and Path(first).exists()
    clock.now += 301  # the first is now past its time
    assert ledger.sweep() == 1 and not Path(first).exists()
    assert ledger.expired(first) and not ledger.expired(second) and ledger.held("a") == 0


def test_a_failed_upload_frees_what_it_reserved():
    ledger = UploadLedger(store_bytes=10 * MB, per_caller_bytes=4 * MB, ttl=600)
    ledger.admit("a", 4 * MB)
    ledger.settle("a", 4 * MB, [])  # refused downstream: nothing stored
    assert ledger.admit("a", 4 * MB) == (200, None)


def test_the_address_is_the_last_hop_no_trusted_proxy_wrote():
    proxies = Proxies(frozenset({"10.0.0.1"}))
    assert proxies.client("192.0.2.9", "203.0.113.5") == "192.0.2.9"  # not through a proxy
    assert proxies.client("10.0.0.1", "203.0.113.5, 198.51.100.7") == "198.51.100.7"
    assert proxies.client("10.0.0.1", "203.0.113.5, 10.0.0.1") == "203.0.113.5"
    assert proxies.client("10.0.0.1", "") == "10.0.0.1"
    with pytest.raises(ValueError, match="'proxy' is not an IP address"):
        uploads.trusted_addresses("10.0.0.1, proxy")


def test_behind_any_proxy_the_caller_cannot_choose_its_address():
    # A Space's proxy appends the address it was reached from; a caller writes what comes before.
    space = Proxies(frozenset({"*"}))
    for written in ("", "6.6.6.6", "6.6.6.6, 7.7.7.7", "1.2.3.4, 198.51.100.7"):
        forwarded = f"{written}, 198.51.100.7" if written else "198.51.100.7"
        assert space.client("10.16.3.80", forwarded) == "198.51.100.7", forwarded
    assert space.client("10.16.3.80", "") == "10.16.3.80"  # no header: the peer
    # Two proxies in front (a CDN, then the platform's): the second hop from the right.
    two = Proxies(frozenset({"*"}), hops=2)
    assert two.client("10.0.0.9", "6.6.6.6, 198.51.100.7, 203.0.113.1") == "198.51.100.7"
    assert two.client("10.0.0.9", "198.51.100.7") == "198.51.100.7"  # fewer hops than set: the first


def test_many_tiny_files_cost_their_disk_and_count_against_the_caller(tmp_path):
    folder = tmp_path / "uploads"
    ledger = UploadLedger(
        store_bytes=10 * MB, per_caller_bytes=1 * MB, ttl=600, per_caller_files=5, root=folder
    )

    def upload(caller: str, files: int, size: int = 6) -> tuple[list[str], object]:
        paths = []
        for i in range(files):
            (folder / f"h{caller}{len(list(folder.glob('*')))}-{i}").mkdir(parents=True)
        for i, sub in enumerate(sorted(folder.glob(f"h{caller}*"))[-files:]):
            paths.append(stored(sub, f"f{i}.txt", size))
        assert ledger.admit(caller, files * size)[0] == 200
        return paths, ledger.settle(caller, files * size, paths)

    kept, refusal = upload("a", 4)
    assert refusal is None and ledger.held("a") == 4 * disk_charge(6) == 4 * 8192
    # Two more would make six files: the whole upload is refused, and none of it stays on disk.
    more, refusal = upload("a", 2)
    assert refusal[0] == 429 and "BRAG_MAX_UPLOAD_FILES_PER_CALLER" in refusal[1]
    assert not any(Path(p).exists() or Path(p).parent.exists() for p in more)
    assert all(Path(p).exists() for p in kept) and ledger.held("a") == 4 * 8192
    # Another caller has its own share; at the file cap nothing more is admitted at all.
    assert upload("b", 5)[1] is None
    assert ledger.admit("b", 1)[0] == 429


def test_a_deleted_upload_takes_its_folder_and_the_servers_record_of_it(tmp_path):
    folder = tmp_path / "uploads"
    forgotten: list[str] = []
    clock = Clock()
    ledger = UploadLedger(
        store_bytes=10 * MB,
        per_caller_bytes=4 * MB,
        ttl=600,
        clock=clock,
        root=folder,
        forget=forgotten.append,
    )
    (folder / "h1").mkdir(parents=True)
    (folder / "h2").mkdir()
    read, old = stored(folder / "h1", "read.md", 10), stored(folder / "h2", "old.md", 10)
    for path in (read, old):
        ledger.admit("a", 10)
        ledger.settle("a", 10, [path])
    ledger.release(read)  # a request read it
    assert not (folder / "h1").exists() and forgotten == [str(Path(read).resolve())]
    clock.now += 601
    assert ledger.sweep() == 1
    assert not (folder / "h2").exists() and folder.is_dir()  # its folder goes; the upload folder stays
    assert forgotten[-1] == str(Path(old).resolve())


def test_a_files_input_names_only_uploads_and_at_most_the_limit(tmp_path):
    folder = tmp_path / "uploads"
    (folder / "h").mkdir(parents=True)
    good = stored(folder / "h", "notes.md", 10)
    check_file_data([{"path": good}], folder, files=2, kept=lambda p: False)
    check_file_data(None, folder, files=2, kept=lambda p: False)
    kept = str(folder / "h" / "gone.md")  # read before and deleted: a session still keeps it
    check_file_data([{"path": kept}], folder, files=2, kept=lambda p: p == kept)
    with pytest.raises(ValueError, match=r"3 files, over the limit of 2 \(BRAG_MAX_FILES\)"):
        check_file_data([{"path": good}] * 3, folder, files=2, kept=lambda p: False)
    outside = stored(tmp_path, "secret.txt", 10)
    for path in (
        "http://198.51.100.1/big.bin",
        "file:///etc/passwd",
        "//198.51.100.1/share",
        outside,
        str(folder / "h" / ".." / ".." / "secret.txt"),
        str(folder / "h" / "missing.md"),
        "",
        "a\0b",
        7,
    ):
        with pytest.raises(ValueError, match="never read"):
            check_file_data([{"path": path}], folder, files=2, kept=lambda p: False)


def gradio_like(stored_paths: list[str]):
    """What the routes wrap: answers an upload with the stored paths, anything else with 200 "served"."""

    async def app(scope, receive, send):
        await receive()
        body = json.dumps(stored_paths).encode() if scope["path"].endswith("/upload") else b"served"
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": body})

    return app


def test_the_routes_admit_uploads_by_the_ledger_and_serve_only_the_apps_own_files(tmp_path):
    upload = stored(tmp_path, "upload.bin", 3 * MB)
    download = stored(tmp_path, "fit-0123456789ab.json", 10)
    ledger = UploadLedger(store_bytes=10 * MB, per_caller_bytes=4 * MB, ttl=600)
    routes = UploadRoutes(
        gradio_like([upload]),
        ledger,
        served=lambda p: p == download,
        proxies=Proxies(frozenset({"10.0.0.1"})),
    )
    size = {"content-length": str(3 * MB)}
    assert call_asgi(routes, "/gradio_api/upload", headers=size)[0] == 200
    assert ledger.held("192.0.2.9") == disk_charge(3 * MB)
    status, body = call_asgi(routes, "/gradio_api/upload", headers=size)
    assert status == 429 and b"BRAG_MAX_UPLOAD_BYTES_PER_CALLER" in body
    # Behind the trusted proxy another caller has its own share.
    behind = {**size, "x-forwarded-for": "198.51.100.7"}
    assert call_asgi(routes, "/gradio_api/upload", headers=behind, client=("10.0.0.1", 1))[0] == 200
    for path in (upload, "http://198.51.100.1/x", "/etc/passwd", f"{tmp_path}/../{tmp_path.name}/upload.bin"):
        for route in ("/gradio_api/file=", "/gradio_api/file/", "/file="):
            assert call_asgi(routes, route + path)[0] == 403, (route, path)
    assert call_asgi(routes, "/gradio_api/file=" + download) == (200, b"served")
    assert call_asgi(routes, "/gradio_api/info") == (200, b"served")


def test_an_upload_past_the_callers_share_is_refused_whole_and_leaves_nothing(tmp_path):
    folder = tmp_path / "uploads"
    paths = []
    for i in range(4):
        (folder / f"h{i}").mkdir(parents=True)
        paths.append(stored(folder / f"h{i}", f"tiny{i}.txt", 6))
    ledger = UploadLedger(store_bytes=10 * MB, per_caller_bytes=MB, ttl=600, per_caller_files=3, root=folder)
    routes = UploadRoutes(gradio_like(paths), ledger, served=lambda p: False, proxies=Proxies())
    status, body = call_asgi(routes, "/gradio_api/upload", headers={"content-length": "24"})
    assert status == 429 and b"BRAG_MAX_UPLOAD_FILES_PER_CALLER" in body  # not Gradio's list of paths
    assert not any(Path(p).exists() for p in paths) and list(folder.iterdir()) == []
    assert ledger.held("192.0.2.9") == 0


def test_the_default_limits_take_a_manuals_tree_and_a_caller_still_holds_only_its_share(tmp_path):
    from bragkit.serving.limits import Limits

    limits = Limits()
    assert (limits.files, limits.files_bytes) == (300, 30 * MB)  # an ordinary manual's tree
    folder = tmp_path / "uploads"
    ledger = UploadLedger(  # as the server builds it
        limits.upload_store_bytes,
        limits.caller_upload_share(),
        limits.upload_ttl,
        per_caller_files=limits.caller_upload_files(),
        store_files=limits.upload_store_files,
        root=folder,
    )

    def tree(caller: str, number: int) -> list[str]:
        """A request's worth of files at the limits: 300 files of 30 MB in all (sparse on disk)."""
        paths = []
        for i in range(limits.files):
            (folder / f"{caller}{number}-{i}").mkdir(parents=True)
            path = folder / f"{caller}{number}-{i}" / f"page{i}.html"
            with open(path, "wb") as out:
                out.truncate(limits.files_bytes // limits.files)
            paths.append(str(path))
        return paths

    def upload(caller: str, paths: list[str]) -> tuple[int, str | None] | None:
        body = limits.files_bytes + 300 * 200  # the files and their multipart framing
        status, why = ledger.admit(caller, body)
        return (status, why) if why else ledger.settle(caller, body, paths)

    assert upload("a", tree("a", 1)) is None  # one tree fits a caller's share
    assert upload("a", tree("a", 2)) is None  # and a second, on its way while the first waits
    # A third is refused as it arrives, before its body is read: nothing of it is stored.
    status, why = ledger.admit("a", limits.files_bytes)
    assert status == 429 and "BRAG_MAX_UPLOAD_BYTES_PER_CALLER" in why
    assert upload("b", tree("b", 1)) is None  # another caller has a share of its own
    assert ledger.held("a") <= limits.caller_upload_share() < limits.upload_store_bytes / 2


def test_the_limits_that_must_hold_together_are_checked_at_start_up(monkeypatch):
    from bragkit.serving import guards
    from bragkit.serving.limits import Limits

    limits = Limits()
    limits.check()
    # What a request of a whole tree passes on its way: the upload route, the body guards.
    assert limits.upload_file_bytes() >= limits.files_bytes  # a .zip may hold all the files
    assert limits.upload_body_bytes() > limits.files_bytes
    assert limits.caller_upload_files() >= limits.files and limits.caller_upload_share() > limits.files_bytes
    three_hundred = json.dumps([{"path": f"/tmp/gradio/{'a' * 64}/page{i}.html"} for i in range(300)])
    assert len(three_hundred) < guards.max_request_bytes(limits) and limits.passages >= 20_000
    with pytest.raises(ValueError, match=r"BRAG_MAX_UPLOAD_STORE_BYTES .* two callers' shares"):
        Limits(upload_store_bytes=100 * MB).check()
    with pytest.raises(ValueError, match=r"BRAG_MAX_UPLOAD_STORE_FILES .* two callers' shares of 600 files"):
        Limits(upload_store_files=1_000).check()
    monkeypatch.setenv("BRAG_MAX_FILES_BYTES", str(400 * MB))  # a tree larger than the store holds twice
    with pytest.raises(SystemExit, match="BRAG_MAX_UPLOAD_STORE_BYTES"):
        Limits.from_env()
