"""An email-search agent over a small bundled synthetic inbox, judged by RULER (docs/examples.md)."""
