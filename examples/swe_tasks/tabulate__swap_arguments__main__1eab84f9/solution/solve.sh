#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/tabulate/__init__.py b/tabulate/__init__.py
--- a/tabulate/__init__.py
+++ b/tabulate/__init__.py
@@ -2978,8 +2978,8 @@
     usage = textwrap.dedent(_main.__doc__)
     try:
         opts, args = getopt.getopt(
+            "h1o:s:F:I:f:",
             sys.argv[1:],
-            "h1o:s:F:I:f:",
             [
                 "help",
                 "header",
SLIME_ENV_SWE_PATCH
