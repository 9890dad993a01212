"""Decide: qualify a form at a captured call, gate it (accuracy, then speed), agree over ranks, reuse a receipt."""
