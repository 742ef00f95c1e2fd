import os


def test_current():
    assert os.path.islink("/app/current")
    assert os.readlink("/app/current").rstrip("/") in ("releases/v2", "./releases/v2")
    assert open("/app/current/VERSION").read() == "2\n"


def test_latest():
    assert os.path.islink("/app/latest.log")
    assert not os.path.isabs(os.readlink("/app/latest.log"))
    assert open("/app/latest.log").read() == "two\n"
