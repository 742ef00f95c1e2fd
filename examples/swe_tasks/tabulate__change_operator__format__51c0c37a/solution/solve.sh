#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/tabulate/__init__.py b/tabulate/__init__.py
--- a/tabulate/__init__.py
+++ b/tabulate/__init__.py
@@ -1354,7 +1354,7 @@
                     if digits.isdigit():
                         val_new = (
                             colored.group(1)
-                            + format(int(digits), intfmt)
+                            - format(int(digits), intfmt)
                             + colored.group(3)
                         )
                         val = val_new.encode("utf-8").decode("unicode_escape")
SLIME_ENV_SWE_PATCH
