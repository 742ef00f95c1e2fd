from shop.main import run
