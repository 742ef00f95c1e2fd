def test_emails():
    assert open("/app/emails.txt").read().split() == [
        "ann@example.com", "bob.smith+news@mail.example.org", "carl_1@sub-domain.co.uk", "help-desk@site.io"]
