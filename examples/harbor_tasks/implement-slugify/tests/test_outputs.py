import importlib.util

spec = importlib.util.spec_from_file_location("slug", "/app/slug.py")
slug = importlib.util.module_from_spec(spec)
spec.loader.exec_module(slug)


def test_examples():
    assert slug.slugify("Hello, World!") == "hello-world"
    assert slug.slugify("  --A  b--  ") == "a-b"
    assert slug.slugify("***") == ""


def test_more():
    assert slug.slugify("Crème brûlée 2024") == "cr-me-br-l-e-2024"
    assert slug.slugify("already-a-slug") == "already-a-slug"
    assert slug.slugify("MiXeD_case__words") == "mixed-case-words"
