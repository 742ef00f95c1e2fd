import csv


def test_rows():
    rows = list(csv.DictReader(open("/app/users_clean.csv", newline="")))
    got = sorted((r["name"], r["email"], r["signup"]) for r in rows)
    assert got == [("alice", "alice@x.org", "2023-12-01"), ("bob b", "bob@X.org", "2024-03-01"),
                   ("carol", "carol@x.org", "2022-07-07")]
