import csv


def rows():
    with open("/app/errors.csv", newline="") as f:
        return list(csv.reader(f))


def test_header():
    assert rows()[0] == ["ip", "timestamp", "method", "path", "status"]


def test_rows():
    assert rows()[1:] == [
        ["10.0.0.2", "01/Mar/2025:10:00:05 +0000", "GET", "/api/users", "500"],
        ["10.0.0.1", "01/Mar/2025:10:02:10 +0000", "GET", "/api/orders?id=3", "503"],
        ["10.0.0.4", "01/Mar/2025:10:03:33 +0000", "DELETE", "/api/users/9", "502"],
    ]
