#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/tabulate/__init__.py b/tabulate/__init__.py
--- a/tabulate/__init__.py
+++ b/tabulate/__init__.py
@@ -2812,7 +2812,7 @@
             # Consider escape codes when breaking words up
             total_escape_len = 0
             last_group = 0
-            if _ansi_codes.search(chunk) is not None:
+            if _ansi_codes.search(chunk) is None:
                 for group, _, _, _ in _ansi_codes.findall(chunk):
                     escape_len = len(group)
                     if (
SLIME_ENV_SWE_PATCH
