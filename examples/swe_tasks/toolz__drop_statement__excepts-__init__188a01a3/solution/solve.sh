#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/toolz/functoolz.py b/toolz/functoolz.py
--- a/toolz/functoolz.py
+++ b/toolz/functoolz.py
@@ -860,7 +860,6 @@
     """
     def __init__(self, exc, func, handler=return_none):
         self.exc = exc
-        self.func = func
         self.handler = handler
 
     def __call__(self, *args, **kwargs):
SLIME_ENV_SWE_PATCH
