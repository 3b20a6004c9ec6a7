"""Everything about the package is in pyproject.toml; this file only ships oscar_hf_lm_eval.pth.

The .pth file goes to site-packages itself (not inside the package), so that the stock
``lm_eval --model oscar`` command can find the model; see oscar_hf/evaluation/lm_eval_plugin.py.
setuptools has no pyproject option for a top-level file, hence this build_py step.
"""

import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH_FILE = "oscar_hf_lm_eval.pth"


class BuildPyWithPth(build_py):
    def run(self):
        super().run()
        self.copy_file(os.path.join("oscar_hf", PTH_FILE), os.path.join(self._pth_dir(), PTH_FILE))

    def _pth_dir(self):
        # An editable wheel is made from the install folder; its build_lib is thrown away.
        if getattr(self, "editable_mode", False):
            return self.get_finalized_command("install").install_lib
        return self.build_lib


setup(cmdclass={"build_py": BuildPyWithPth})
