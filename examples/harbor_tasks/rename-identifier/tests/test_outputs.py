from pathlib import Path

S = Path("/app/src")


def test_renamed():
    assert (S / "app.py").read_text() == "from lib import bar_client\n\nbar_client.connect()\nfoo_client_factory = 1\n"
    assert (S / "lib/__init__.py").read_text() == "bar_client = object()\n"


def test_others_untouched():
    assert (S / "NOTES.md").read_text() == "foo_client is deprecated\n"
