"""The task folders here are fixtures, not tests of this repository: pytest must not collect their tests/."""

collect_ignore_glob = ["*/tests/*"]
