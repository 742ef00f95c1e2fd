from pathlib import Path

P = Path("/app/photos")


def test_renamed():
    names = sorted(p.name for p in P.iterdir())
    assert names == ["notes.txt", "photo-0001.jpg", "photo-0007.jpg", "photo-0042.jpg", "photo-1999.jpg"]


def test_contents_kept():
    assert (P / "photo-0042.jpg").read_text() == "image 42\n"
    assert (P / "notes.txt").read_text() == "keep me\n"
