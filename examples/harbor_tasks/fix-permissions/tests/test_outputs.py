import os
import stat


def mode(p):
    return stat.S_IMODE(os.stat(p).st_mode)


def test_modes():
    assert mode("/app/bin/run.sh") == 0o755
    assert mode("/app/secrets/key.txt") == 0o600
    assert mode("/app/secrets") == 0o700
    assert mode("/app/shared/notes.txt") == 0o664


def test_owner_kept():
    assert os.stat("/app/secrets/key.txt").st_uid == 1000
