"""Views: edited contexts that rows are re-scored under (``Need(view=NAME)``; protocol in ``components.View``)."""
