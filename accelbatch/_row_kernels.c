/* Compiled twins of two loops in accelbatch/row_kernels.py (the reference; see its docstrings).
 *
 * advance_rows: move a BatchWorld's teacher rows one example on (RowBlock.act).
 * count_replies: count (reply text, answers) pairs of a batch into a dict (Metrics.add_replies).
 *
 * Both do exactly what their Python twins do, with the same errors for bad input; tests run the two
 * side by side. The build treats this module as optional: without a C compiler the Python twins run.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* list[i] as a C index, or -1 with an exception set. */
static Py_ssize_t
index_at(PyObject *list, Py_ssize_t i)
{
    return PyLong_AsSsize_t(PyList_GET_ITEM(list, i));
}

static int
check_list(PyObject *obj, const char *name)
{
    if (!PyList_CheckExact(obj)) {
        PyErr_Format(PyExc_TypeError, "advance_rows: %s must be a list", name);
        return -1;
    }
    return 0;
}

/* advance_rows(pos, end, first, rows, starts, ends, numbers, flat, take, loop)
 *     -> (examples: list, served: list[int], real_rows: int)
 *
 * Rows first .. first+rows-1 of the slot columns pos/end each serve their next example: pos[slot] while
 * pos[slot] < end[slot], else the first example of the episode take(k, loop) hands them (k = the number of
 * such rows, in row order; None: nothing left, the row serves the padding index, len(numbers) - 2). pos
 * becomes served + 1, end the episode's end for rows that started one (padding for rows that got None).
 * numbers[i] is the int i (no int is created per row). Returns each row's example flat[served], the served
 * flat indices, and how many rows served an example (not the padding).
 */
static PyObject *
advance_rows(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *pos, *end, *starts, *ends, *numbers, *flat, *take, *loop;
    Py_ssize_t first, rows;
    if (!PyArg_ParseTuple(args, "OOnnOOOOOO:advance_rows", &pos, &end, &first, &rows, &starts, &ends, &numbers,
                          &flat, &take, &loop))
        return NULL;
    if (check_list(pos, "pos") || check_list(end, "end") || check_list(starts, "starts")
        || check_list(ends, "ends") || check_list(numbers, "numbers") || check_list(flat, "flat"))
        return NULL;
    Py_ssize_t pad = PyList_GET_SIZE(numbers) - 2;
    if (pad < 0 || PyList_GET_SIZE(flat) != pad + 1) {
        PyErr_SetString(PyExc_ValueError, "advance_rows: numbers must be 0 .. len(flat), flat end with the padding");
        return NULL;
    }
    if (first < 0 || rows < 0 || first + rows > PyList_GET_SIZE(pos) || first + rows > PyList_GET_SIZE(end)) {
        PyErr_SetString(PyExc_IndexError, "advance_rows: rows outside the slot columns");
        return NULL;
    }
    PyObject *served = PyList_New(rows);
    PyObject *examples = PyList_New(rows);
    Py_ssize_t *starting = PyMem_New(Py_ssize_t, rows > 0 ? rows : 1);
    if (served == NULL || examples == NULL || starting == NULL) {
        Py_XDECREF(served);
        Py_XDECREF(examples);
        PyMem_Free(starting);
        return PyErr_NoMemory();
    }
    Py_ssize_t count = 0;
    for (Py_ssize_t r = 0; r < rows; r++) {
        PyObject *at = PyList_GET_ITEM(pos, first + r);
        Py_ssize_t p = PyLong_AsSsize_t(at);
        Py_ssize_t e = index_at(end, first + r);
        if ((p == -1 || e == -1) && PyErr_Occurred())
            goto fail;
        if (p >= e)
            starting[count++] = r;
        else {
            Py_INCREF(at);
            PyList_SET_ITEM(served, r, at);
        }
    }
    if (count > 0) {
        PyObject *taken = PyObject_CallFunction(take, "nO", count, loop);
        if (taken == NULL)
            goto fail;
        PyObject *fast = PySequence_Fast(taken, "advance_rows: take() must return a sequence");
        Py_DECREF(taken);
        if (fast == NULL)
            goto fail;
        if (PySequence_Fast_GET_SIZE(fast) != count) {
            PyErr_Format(PyExc_ValueError, "advance_rows: take(%zd) returned %zd episodes", count,
                         PySequence_Fast_GET_SIZE(fast));
            Py_DECREF(fast);
            goto fail;
        }
        for (Py_ssize_t j = 0; j < count; j++) {
            PyObject *episode = PySequence_Fast_GET_ITEM(fast, j);
            PyObject *start, *stop;
            if (episode == Py_None) {
                start = stop = PyList_GET_ITEM(numbers, pad);
                Py_INCREF(start);
                Py_INCREF(stop);
            }
            else {
                Py_ssize_t e = PyLong_AsSsize_t(episode);
                if (e == -1 && PyErr_Occurred()) {
                    Py_DECREF(fast);
                    goto fail;
                }
                if (e < 0 || e >= PyList_GET_SIZE(starts) || e >= PyList_GET_SIZE(ends)) {
                    PyErr_Format(PyExc_IndexError, "advance_rows: episode %zd out of range", e);
                    Py_DECREF(fast);
                    goto fail;
                }
                start = PyList_GET_ITEM(starts, e);
                stop = PyList_GET_ITEM(ends, e);
                Py_INCREF(start);
                Py_INCREF(stop);
            }
            Py_ssize_t r = starting[j];
            PyList_SET_ITEM(served, r, start);
            if (PyList_SetItem(end, first + r, stop) < 0) {  /* steals stop */
                Py_DECREF(fast);
                goto fail;
            }
        }
        Py_DECREF(fast);
    }
    Py_ssize_t real_rows = 0;
    for (Py_ssize_t r = 0; r < rows; r++) {
        Py_ssize_t s = PyLong_AsSsize_t(PyList_GET_ITEM(served, r));
        if (s == -1 && PyErr_Occurred())
            goto fail;
        if (s < 0 || s > pad) {
            PyErr_Format(PyExc_IndexError, "advance_rows: flat index %zd out of range", s);
            goto fail;
        }
        real_rows += s != pad;
        PyObject *example = PyList_GET_ITEM(flat, s);
        Py_INCREF(example);
        PyList_SET_ITEM(examples, r, example);
        PyObject *next = PyList_GET_ITEM(numbers, s + 1);
        Py_INCREF(next);
        if (PyList_SetItem(pos, first + r, next) < 0)
            goto fail;
    }
    PyMem_Free(starting);
    return Py_BuildValue("(NNn)", examples, served, real_rows);
fail:
    PyMem_Free(starting);
    /* rows not yet filled hold NULL, which list deallocation skips */
    Py_DECREF(served);
    Py_DECREF(examples);
    return NULL;
}

/* 1 when type's get() is dict.get (a dict or a subclass that keeps it), 0 if not, -1 on error. */
static int
uses_dict_get(PyTypeObject *type)
{
    if (type == &PyDict_Type)
        return 1;
    PyObject *mine = PyObject_GetAttrString((PyObject *)type, "get");
    if (mine == NULL)
        return -1;
    PyObject *dicts = PyObject_GetAttrString((PyObject *)&PyDict_Type, "get");
    if (dicts == NULL) {
        Py_DECREF(mine);
        return -1;
    }
    int same = mine == dicts;
    Py_DECREF(mine);
    Py_DECREF(dicts);
    return same;
}

/* count_replies(counts, replies, served, answers, key) -> None
 *
 * For each row r: counts[answers[served[r]]][replies[r].get(key)] += 1 (counts: answers -> reply -> rows;
 * an inner dict is created the first time its answers are seen).
 */
static PyObject *
count_replies(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *counts, *replies, *served, *answers, *key;
    if (!PyArg_ParseTuple(args, "O!O!O!O!O:count_replies", &PyDict_Type, &counts, &PyList_Type, &replies,
                          &PyList_Type, &served, &PyList_Type, &answers, &key))
        return NULL;
    Py_ssize_t rows = PyList_GET_SIZE(replies);
    if (PyList_GET_SIZE(served) != rows) {
        PyErr_Format(PyExc_ValueError, "count_replies: %zd replies for %zd served examples", rows,
                     PyList_GET_SIZE(served));
        return NULL;
    }
    PyObject *one = PyLong_FromLong(1);
    PyTypeObject *plain_type = NULL;  /* the last reply type known to read text with dict.get */
    for (Py_ssize_t r = 0; r < rows; r++) {
        PyObject *reply = PyList_GET_ITEM(replies, r);
        PyObject *text;
        if (Py_TYPE(reply) != plain_type) {  /* a dict whose get() is dict.get: read it directly */
            int plain = PyDict_Check(reply) && uses_dict_get(Py_TYPE(reply));
            if (plain < 0)
                goto fail;
            plain_type = plain ? Py_TYPE(reply) : NULL;
        }
        if (plain_type != NULL) {
            text = PyDict_GetItemWithError(reply, key);
            if (text == NULL && PyErr_Occurred())
                goto fail;
            text = text ? text : Py_None;
            Py_INCREF(text);
        }
        else {
            text = PyObject_CallMethod(reply, "get", "O", key);
            if (text == NULL)
                goto fail;
        }
        Py_ssize_t s = index_at(served, r);
        if (s == -1 && PyErr_Occurred()) {
            Py_DECREF(text);
            goto fail;
        }
        if (s < 0 || s >= PyList_GET_SIZE(answers)) {
            Py_DECREF(text);
            PyErr_Format(PyExc_IndexError, "count_replies: served index %zd out of range", s);
            goto fail;
        }
        PyObject *target = PyList_GET_ITEM(answers, s);
        PyObject *by_reply = PyDict_GetItemWithError(counts, target);
        if (by_reply == NULL) {
            if (PyErr_Occurred() || (by_reply = PyDict_New()) == NULL) {
                Py_DECREF(text);
                goto fail;
            }
            int stored = PyDict_SetItem(counts, target, by_reply);
            Py_DECREF(by_reply);  /* counts holds it */
            if (stored < 0) {
                Py_DECREF(text);
                goto fail;
            }
        }
        PyObject *seen = PyDict_GetItemWithError(by_reply, text);
        PyObject *total;
        if (seen == NULL) {
            if (PyErr_Occurred()) {
                Py_DECREF(text);
                goto fail;
            }
            total = one;
            Py_INCREF(total);
        }
        else {
            long rows_before = PyLong_AsLong(seen);
            total = rows_before == -1 && PyErr_Occurred() ? NULL : PyLong_FromLong(rows_before + 1);
        }
        if (total == NULL || PyDict_SetItem(by_reply, text, total) < 0) {
            Py_XDECREF(total);
            Py_DECREF(text);
            goto fail;
        }
        Py_DECREF(total);
        Py_DECREF(text);
    }
    Py_DECREF(one);
    Py_RETURN_NONE;
fail:
    Py_DECREF(one);
    return NULL;
}

static PyMethodDef methods[] = {
    {"advance_rows", advance_rows, METH_VARARGS, "Move a block of teacher rows one example on."},
    {"count_replies", count_replies, METH_VARARGS, "Count the (answers, reply text) pairs of a batch."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "accelbatch._row_kernels", "Compiled twins of accelbatch.row_kernels.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__row_kernels(void)
{
    return PyModule_Create(&module);
}
