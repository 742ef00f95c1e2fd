import tarfile


def test_archive():
    with tarfile.open("/app/backup.tar.gz", "r:gz") as t:
        files = sorted(m.name for m in t.getmembers() if m.isfile())
        assert files == ["docs/api/ref.md", "docs/guide.md"]
        assert t.extractfile("docs/guide.md").read() == b"# Guide\n"
