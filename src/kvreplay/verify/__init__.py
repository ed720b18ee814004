"""Verdicts (design: verdict, level, power): what a stack was expected to do
(``expectation``), each item judged at two levels (``outcome``), the verdict as a value
with one definition of the items it judges (``verdict``), and its renderings: a
sentence, JSON, JUnit and a screen (``render``)."""
