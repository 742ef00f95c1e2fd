from pathlib import Path


def test_parts():
    parts = sorted(Path("/app/parts").iterdir())
    assert [p.name for p in parts] == ["part-000.txt", "part-001.txt", "part-002.txt"]
    assert [len(p.read_text().splitlines()) for p in parts] == [100, 100, 50]
    assert "".join(p.read_text() for p in parts) == Path("/app/big.txt").read_text()
