"""Browser tests: headless Chromium over the built book (``make browser-test``, after ``make book``)."""
