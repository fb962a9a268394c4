"""The extractor against hostile archives: a snapshot comes from a bucket we do not trust, so no
member, and no link target, may reach outside the restore's target directory."""

from __future__ import annotations

import io
import os
import re
import tarfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from pgherd_backup.errors import IntegrityError
from pgherd_backup.tarstream import extract


@dataclass(frozen=True)
class Place:
    target: Path
    outside: Path  # a sibling of the target, holding one file that must stay as it is

    def untouched(self) -> bool:
        return [p.name for p in self.outside.iterdir()] == ["sentinel"] and (
            self.outside / "sentinel"
        ).read_bytes() == b"keep"


@pytest.fixture
def place(tmp_path_factory: pytest.TempPathFactory) -> Place:
    # a short base keeps absolute link targets inside ustar's 100-byte link field
    base = tmp_path_factory.mktemp("x")
    (base / "outside").mkdir()
    (base / "outside" / "sentinel").write_bytes(b"keep")
    return Place(base / "target", base / "outside")


def _file(name: str, data: bytes = b"owned") -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data), 0o600
    return info, data


def _dir(name: str) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.type, info.mode = tarfile.DIRTYPE, 0o700
    return info, b""


def _link(name: str, target: str, kind: bytes = tarfile.SYMTYPE) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info, b""


def _special(name: str, kind: bytes) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.type = kind
    return info, b""


def _tar(*members: tuple[tarfile.TarInfo, bytes], form: int = tarfile.USTAR_FORMAT) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=form) as archive:
        for info, data in members:
            archive.addfile(info, io.BytesIO(data) if data else None)
    return buffer.getvalue()


def _refused(place: Place, stream: bytes, member: str, why: str = "") -> None:
    """Extraction stops with an error naming `member` (and saying `why`), nothing outside changed, and
    the directory descriptors the extractor walks with are all closed."""
    with pytest.raises(IntegrityError, match=re.escape(repr(member))) as caught:
        extract(io.BytesIO(stream), place.target)
    assert why in str(caught.value)
    assert place.untouched()
    # Counted by where they point, not how many: other threads of the session open and close theirs.
    assert not _descriptors_under(place.target.parent)


def _descriptors_under(root: Path) -> list[str]:
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            where = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if where == str(root) or where.startswith(f"{root}/"):
            found.append(where)
    return found


def test_a_symlink_to_an_absolute_path_cannot_be_written_through(place: Place) -> None:
    stream = _tar(_link("escape", str(place.outside)), _file("escape/owned"))
    _refused(place, stream, "escape", "absolute")


def test_a_symlink_climbing_out_cannot_be_written_through(place: Place) -> None:
    stream = _tar(_dir("base"), _link("base/escape", "../../outside"), _file("base/escape/owned"))
    _refused(place, stream, "base/escape", "outside the target directory")


def test_a_chain_of_symlinks_cannot_climb_out(place: Place) -> None:
    stream = _tar(_link("a", "b"), _link("b", ".."), _file("a/outside/owned"))
    _refused(place, stream, "b", "outside the target directory")


def test_a_symlink_stepping_back_out_of_another_symlink_is_refused(place: Place) -> None:
    # each target stays inside when read as text, but ".." taken after a link follows the link:
    # l -> a/b/s/../.. really names the target's parent
    stream = _tar(
        _dir("a"), _dir("a/b"), _dir("c"), _link("a/b/s", "../../c"), _link("l", "a/b/s/../.."), _file("l/x")
    )
    _refused(place, stream, "l", "goes through the symbolic link 'a/b/s'")


def test_a_symlink_made_where_an_earlier_link_steps_through_is_refused(place: Place) -> None:
    stream = _tar(_link("l", "a/b/s/../.."), _dir("a"), _dir("a/b"), _dir("c"), _link("a/b/s", "../../c"))
    _refused(place, stream, "a/b/s", "'l'")


@pytest.mark.parametrize("target", ["../outside/sentinel", "/etc/passwd", "alias/file"])
def test_hard_links_are_refused(place: Place, target: str) -> None:
    stream = _tar(
        _dir("real"), _file("real/file"), _link("alias", "real"), _link("hard", target, tarfile.LNKTYPE)
    )
    _refused(place, stream, "hard", "hard link")


# tarfile ends directory names with "/"
@pytest.mark.parametrize(("target", "refused"), [("../../outside", "pg/sub"), ("../real", "pg/sub/deeper/")])
def test_a_directory_member_under_an_earlier_symlink_is_refused(
    place: Place, target: str, refused: str
) -> None:
    stream = _tar(
        _dir("pg"), _dir("real"), _link("pg/sub", target), _dir("pg/sub/deeper"), _file("pg/sub/deeper/owned")
    )
    _refused(place, stream, refused)
    assert not (place.target / "real" / "deeper").exists()


def test_a_file_under_a_symlinked_parent_is_refused_even_when_the_link_stays_inside(place: Place) -> None:
    stream = _tar(_dir("real"), _link("alias", "real"), _file("alias/file"))
    _refused(place, stream, "alias/file", "symbolic link")
    assert not (place.target / "real" / "file").exists()


@pytest.mark.parametrize("size", [6, 2 << 20], ids=["written-by-a-thread", "streamed"])
def test_a_file_is_not_written_through_a_symlink_of_the_same_name(place: Place, size: int) -> None:
    stream = _tar(_file("real", b"first"), _link("alias", "real"), _file("alias", bytes(size)))
    _refused(place, stream, "alias", "symbolic link")
    assert (place.target / "real").read_bytes() == b"first"


@pytest.mark.parametrize("target", ["/anywhere", "../outside", "../../..", "a/../../outside", ".."])
def test_a_symlink_pointing_outside_is_refused_even_with_nothing_written_through_it(
    place: Place, target: str
) -> None:
    _refused(place, _tar(_link("lonely", target)), "lonely")
    assert not (place.target / "lonely").is_symlink()


def test_a_tablespace_link_is_refused_with_the_reason(place: Place) -> None:
    # pg_basebackup cannot write a cluster with tablespaces to one stream, so a snapshot holds no
    # tablespace contents a restore could put behind such a link
    stream = _tar(_dir("pg_tblspc"), _link("pg_tblspc/16385", "/var/lib/postgresql/ts"))
    _refused(place, stream, "pg_tblspc/16385", "tablespaces outside the data directory")
    assert not (place.target / "pg_tblspc" / "16385").is_symlink()


@pytest.mark.parametrize(
    ("kind", "what"),
    [(tarfile.CHRTYPE, "character device"), (tarfile.BLKTYPE, "block device"), (tarfile.FIFOTYPE, "FIFO")],
)
def test_devices_and_fifos_are_refused(place: Place, kind: bytes, what: str) -> None:
    _refused(place, _tar(_dir("dev"), _special("dev/node", kind)), "dev/node", what)
    assert not (place.target / "dev" / "node").exists()


def _pax_named(name: str, data: bytes = b"owned") -> tuple[tarfile.TarInfo, bytes]:
    info, data = _file("placeholder", data)
    info.pax_headers = {"path": name}
    return info, data


@pytest.mark.parametrize(
    "name",
    ["a\0b", "../outside/owned", "a/../../outside/owned", "./../outside/owned", "/abs/owned", "a/./../../x"],
)
def test_member_names_that_are_unsafe_are_refused(place: Place, name: str) -> None:
    _refused(place, _tar(_pax_named(name), form=tarfile.PAX_FORMAT), name, "unsafe path")


def test_a_long_gnu_name_climbing_out_is_refused(place: Place) -> None:
    name = "../outside/" + "n" * 120
    _refused(place, _tar(_file(name), form=tarfile.GNU_FORMAT), name, "unsafe path")


def test_an_archive_like_pg_basebackup_s_still_extracts(place: Place) -> None:
    big = os.urandom(3 << 20)  # past the size the writer threads take, so it is streamed
    stream = _tar(
        _dir("."),
        _file("./PG_VERSION", b"15\n"),
        _dir("base"),
        _dir("base/1"),
        _file("base/1/1259", big),
        _dir("pg_tblspc"),
        _dir("pg_tblspc/16385"),  # an in-place tablespace is a directory inside the data directory
        _file("pg_tblspc/16385/file", b"inplace"),
        _link("current", "base/1"),  # a link that stays inside is kept
        _link("base/1/up", "../../PG_VERSION"),
        _file("implicit/parent/file", b"deep"),
    )
    owner = 4321 if os.geteuid() == 0 else None
    written = extract(io.BytesIO(stream), place.target, uid=owner, gid=owner)
    assert written == len(big) + len(b"15\n") + len(b"inplace") + len(b"deep")
    assert (place.target / "base/1/1259").read_bytes() == big
    assert (place.target / "pg_tblspc/16385/file").read_bytes() == b"inplace"
    assert os.readlink(place.target / "current") == "base/1"
    assert (place.target / "base/1/up").read_bytes() == b"15\n"
    assert (place.target / "implicit/parent/file").read_bytes() == b"deep"
    if owner is not None:
        for name in (
            ".",
            "PG_VERSION",
            "base/1",
            "base/1/1259",
            "current",
            "implicit",
            "implicit/parent/file",
        ):
            assert (place.target / name).lstat().st_uid == owner, name
    assert place.untouched()
