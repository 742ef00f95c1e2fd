import subprocess


def git(*args):
    return subprocess.run(["git", "-C", "/app/repo", *args], capture_output=True, text=True, check=True).stdout


def test_commit():
    log = git("log", "--format=%s|%an|%ae", "-n", "2").splitlines()
    assert log == ["Fix typo in README|Dev|dev@example.com", "Initial commit|Init|init@example.com"]


def test_content_and_clean():
    assert git("show", "HEAD:README.md") == "Hello world\n"
    assert git("status", "--porcelain") == ""
    assert git("diff", "HEAD~1", "--name-only").split() == ["README.md"]
