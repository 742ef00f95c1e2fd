#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/tabulate/__init__.py b/tabulate/__init__.py
--- a/tabulate/__init__.py
+++ b/tabulate/__init__.py
@@ -853,7 +853,7 @@
         None,
         None,
         headerrow=DataRow("", separator, ""),
-        datarow=DataRow("", separator, ""),
+        datarow=DataRow(separator, "", ""),
         padding=0,
         with_header_hide=None,
     )
SLIME_ENV_SWE_PATCH
