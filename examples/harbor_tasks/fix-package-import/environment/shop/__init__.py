from shop.main import run  # noqa: F401 (re-export)
