#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/toolz/itertoolz.py b/toolz/itertoolz.py
--- a/toolz/itertoolz.py
+++ b/toolz/itertoolz.py
@@ -297,7 +297,7 @@
     >>> isdistinct("World")
     True
     """
-    if iter(seq) is seq:
+    if iter(seq) is not seq:
         seen = set()
         seen_add = seen.add
         for item in seq:
SLIME_ENV_SWE_PATCH
