import csv


def test_order():
    rows = list(csv.reader(open("/app/users_clean.csv", newline="")))
    assert rows[0] == ["name", "email", "signup"]
    names = [r[0] for r in rows[1:]]
    assert len(names) >= 2 and names == sorted(names)
