"""The leaf parts a report page is made of: its blocks and their Markdown and HTML
rendering (``document``) and matplotlib's figures (``figures``, the only module here that
loads matplotlib). Experiments' sections write pages with them and the report assembles
them, so they sit below both."""
