"""The localize experiment, one package: its run (``experiment``, loads torch), its CSV
(``table``) and its section of the analysis and report (``section``). Importing the
package loads nothing: the registry names the modules."""
