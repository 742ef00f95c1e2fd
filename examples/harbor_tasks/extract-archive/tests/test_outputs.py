from pathlib import Path

E = Path("/app/extracted")


def test_files():
    assert sorted(p.name for p in E.iterdir()) == ["a.csv", "b.csv", "readme.txt"]
    assert (E / "b.csv").read_text() == "x,y\n3,4\n"
    assert (E / "readme.txt").read_text() == "read me\n"
