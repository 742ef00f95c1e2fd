#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/toolz/_signatures.py b/toolz/_signatures.py
--- a/toolz/_signatures.py
+++ b/toolz/_signatures.py
@@ -699,7 +699,6 @@
     """ Like ``is_partial_args`` for the given signature spec"""
     num_pos_only, func, keyword_exclude, sigspec = sig
     if len(args) < num_pos_only:
-        pad = (None,) * (num_pos_only - len(args))
         args = args + pad
     if keyword_exclude:
         kwargs = dict(kwargs)
SLIME_ENV_SWE_PATCH
