#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/toolz/functoolz.py b/toolz/functoolz.py
--- a/toolz/functoolz.py
+++ b/toolz/functoolz.py
@@ -251,7 +251,6 @@
         newparams = []
         for param in params[skip:]:
             kind = param.kind
-            default = param.default
             if kind == param.VAR_KEYWORD:
                 pass
             elif kind == param.VAR_POSITIONAL:
SLIME_ENV_SWE_PATCH
