/* Compiled twins of two loops in accelbatch/row_kernels.py (the reference; see its docstrings).
 *
 * advance_rows: move a BatchWorld's teacher rows one example on (RowBlock.act).
 * count_replies: count (answers, reply text) pairs of a batch into a dict (Metrics.add_replies).
 *
 * Both do exactly what their Python twins do, with the same errors for bad input; tests run the two
 * side by side. The build treats this module as optional: without a C compiler the Python twins run.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

/* A one-dimensional, contiguous array('q') (C int64s), taken as a buffer; release with PyBuffer_Release. */
static int
int64_column(PyObject *obj, const char *name, int writable, Py_buffer *view)
{
    if (PyObject_GetBuffer(obj, view, (writable ? PyBUF_WRITABLE : 0) | PyBUF_FORMAT | PyBUF_ND) < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "advance_rows: %s must be a%s array('q')", name, writable ? " writable" : "n");
        return -1;
    }
    if (view->ndim != 1 || view->itemsize != 8 || view->format == NULL || strcmp(view->format, "q") != 0) {
        PyBuffer_Release(view);
        PyErr_Format(PyExc_TypeError, "advance_rows: %s must be an array('q')", name);
        return -1;
    }
    return 0;
}

/* A prefetch hint for the model's reads, which a shuffled order hides from the hardware prefetcher (each read
 * would otherwise wait on memory in turn). A hint only: nothing is read through the address here. */
#if defined(__GNUC__) || defined(__clang__)
#define PREFETCH(address) __builtin_prefetch(address)
#else
#define PREFETCH(address) ((void)(address))
#endif

/* advance_rows(pos, end, first, rows, starts, ends, flat, answers, take, loop)
 *     -> (examples: list, row_answers: list, real_rows: int)
 *
 * Rows first .. first+rows-1 of the slot columns pos/end each serve their next example: pos[slot] while
 * pos[slot] < end[slot], else the first example of the episode take(k, loop) hands them (k = the number of
 * such rows, in row order; None: nothing left, the row serves the padding, the last index of flat). pos
 * becomes served + 1, end the episode's end for rows that started one (padding for rows that got None).
 * pos, end, starts and ends are array('q') columns, read and written in place. Returns each row's example
 * flat[served], its answers answers[served], and how many rows served an example (not the padding).
 */
static PyObject *
advance_rows(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *pos_obj, *end_obj, *starts_obj, *ends_obj, *flat, *answers, *take, *loop;
    Py_ssize_t first, rows;
    if (!PyArg_ParseTuple(args, "OOnnOOO!O!OO:advance_rows", &pos_obj, &end_obj, &first, &rows, &starts_obj,
                          &ends_obj, &PyList_Type, &flat, &PyList_Type, &answers, &take, &loop))
        return NULL;
    Py_ssize_t pad = PyList_GET_SIZE(flat) - 1;
    if (pad < 0 || PyList_GET_SIZE(answers) != pad + 1) {
        PyErr_SetString(PyExc_ValueError,
                        "advance_rows: flat and answers need one entry per example and the padding last");
        return NULL;
    }
    Py_buffer pos_view, end_view, starts_view, ends_view;
    if (int64_column(pos_obj, "pos", 1, &pos_view) < 0)
        return NULL;
    if (int64_column(end_obj, "end", 1, &end_view) < 0) {
        PyBuffer_Release(&pos_view);
        return NULL;
    }
    if (int64_column(starts_obj, "starts", 0, &starts_view) < 0) {
        PyBuffer_Release(&pos_view);
        PyBuffer_Release(&end_view);
        return NULL;
    }
    if (int64_column(ends_obj, "ends", 0, &ends_view) < 0) {
        PyBuffer_Release(&pos_view);
        PyBuffer_Release(&end_view);
        PyBuffer_Release(&starts_view);
        return NULL;
    }
    long long *pos = (long long *)pos_view.buf, *end = (long long *)end_view.buf;
    const long long *starts = (const long long *)starts_view.buf, *ends = (const long long *)ends_view.buf;
    Py_ssize_t episodes = Py_MIN(starts_view.shape[0], ends_view.shape[0]);
    PyObject *examples = NULL, *row_answers = NULL, *result = NULL;
    long long *served = NULL;
    Py_ssize_t *starting = NULL;
    if (first < 0 || rows < 0 || first + rows > pos_view.shape[0] || first + rows > end_view.shape[0]) {
        PyErr_SetString(PyExc_IndexError, "advance_rows: rows outside the slot columns");
        goto done;
    }
    served = PyMem_New(long long, rows > 0 ? rows : 1);
    starting = PyMem_New(Py_ssize_t, rows > 0 ? rows : 1);
    if (served == NULL || starting == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t count = 0;
    for (Py_ssize_t r = 0; r < rows; r++) {
        served[r] = pos[first + r];
        if (served[r] >= end[first + r])
            starting[count++] = r;
    }
    if (count > 0) {
        PyObject *taken = PyObject_CallFunction(take, "nO", count, loop);
        if (taken == NULL)
            goto done;
        PyObject *fast = PySequence_Fast(taken, "advance_rows: take() must return a sequence");
        Py_DECREF(taken);
        if (fast == NULL)
            goto done;
        if (PySequence_Fast_GET_SIZE(fast) != count) {
            PyErr_Format(PyExc_ValueError, "advance_rows: take(%zd) returned %zd episodes", count,
                         PySequence_Fast_GET_SIZE(fast));
            Py_DECREF(fast);
            goto done;
        }
        for (Py_ssize_t j = 0; j < count; j++) {
            PyObject *episode = PySequence_Fast_GET_ITEM(fast, j);
            Py_ssize_t r = starting[j];
            if (episode == Py_None) {
                served[r] = end[first + r] = pad;
                continue;
            }
            Py_ssize_t e = PyLong_AsSsize_t(episode);
            if (e == -1 && PyErr_Occurred()) {
                Py_DECREF(fast);
                goto done;
            }
            if (e < 0 || e >= episodes) {
                PyErr_Format(PyExc_IndexError, "advance_rows: episode %zd out of range", e);
                Py_DECREF(fast);
                goto done;
            }
            served[r] = starts[e];
            end[first + r] = ends[e];
        }
        Py_DECREF(fast);
        if (PyList_GET_SIZE(flat) != pad + 1 || PyList_GET_SIZE(answers) != pad + 1) {  /* take() ran Python */
            PyErr_SetString(PyExc_RuntimeError, "advance_rows: flat or answers changed size during take()");
            goto done;
        }
    }
    for (Py_ssize_t r = 0; r < rows; r++) {
        if (served[r] < 0 || served[r] > pad) {
            PyErr_Format(PyExc_IndexError, "advance_rows: flat index %lld out of range", served[r]);
            goto done;
        }
    }
    examples = PyList_New(rows);
    row_answers = PyList_New(rows);
    if (examples == NULL || row_answers == NULL)
        goto done;
    Py_ssize_t real_rows = 0;
    for (Py_ssize_t r = 0; r < rows; r++) {
        Py_ssize_t s = (Py_ssize_t)served[r];
        real_rows += s != pad;
        PyObject *example = PyList_GET_ITEM(flat, s), *target = PyList_GET_ITEM(answers, s);
        Py_INCREF(example);
        /* its key table, which the model reads next (is it padding, its text): with a shuffled order these
         * reads would each wait on memory; prefetched here, all rows' tables load at once (spec workload,
         * bs 32: the model's batch_act 14.3 -> 8.5 us, as fast as on examples already in cache). Kept inside
         * this loop: gcc -O3 -DNDEBUG deleted a separate loop that did nothing but prefetch. */
        if (PyDict_Check(example)) {
            const char *keys = (const char *)((PyDictObject *)example)->ma_keys;
            PREFETCH(keys);
            PREFETCH(keys + 64);
            PREFETCH(keys + 128);
        }
        Py_INCREF(target);
        PyList_SET_ITEM(examples, r, example);
        PyList_SET_ITEM(row_answers, r, target);
        pos[first + r] = s + 1;
    }
    result = Py_BuildValue("(OOn)", examples, row_answers, real_rows);
done:
    Py_XDECREF(examples);
    Py_XDECREF(row_answers);
    PyMem_Free(served);
    PyMem_Free(starting);
    PyBuffer_Release(&pos_view);
    PyBuffer_Release(&end_view);
    PyBuffer_Release(&starts_view);
    PyBuffer_Release(&ends_view);
    return result;
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

/* count_replies(counts, replies, answers, key) -> None
 *
 * For each row r: counts[answers[r]][replies[r].get(key)] += 1 (counts: answers -> reply -> rows; an inner
 * dict is created the first time its answers are seen). Rows with the same answers object as the row before
 * (a teacher shares one tuple per distinct answers) reuse its inner dict without hashing the tuple again.
 */
static PyObject *
count_replies(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *counts, *replies, *answers, *key;
    if (!PyArg_ParseTuple(args, "O!O!O!O:count_replies", &PyDict_Type, &counts, &PyList_Type, &replies,
                          &PyList_Type, &answers, &key))
        return NULL;
    Py_ssize_t rows = PyList_GET_SIZE(replies);
    if (PyList_GET_SIZE(answers) != rows) {
        PyErr_Format(PyExc_ValueError, "count_replies: %zd replies for %zd rows of answers", rows,
                     PyList_GET_SIZE(answers));
        return NULL;
    }
    PyObject *one = PyLong_FromLong(1);
    PyTypeObject *plain_type = NULL;  /* the last reply type known to read text with dict.get */
    PyObject *last_target = NULL, *by_reply = NULL;  /* by_reply: a strong reference, kept across rows */
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
            if (PyList_GET_SIZE(replies) != rows || PyList_GET_SIZE(answers) != rows) {  /* get() ran Python code */
                PyErr_SetString(PyExc_RuntimeError, "count_replies: the lists changed size during counting");
                Py_DECREF(text);
                goto fail;
            }
        }
        PyObject *target = PyList_GET_ITEM(answers, r);
        if (target != last_target || by_reply == NULL) {
            Py_CLEAR(by_reply);
            Py_INCREF(target);
            Py_XSETREF(last_target, target);  /* held, so its address cannot be reused by another object */
            by_reply = PyDict_GetItemWithError(counts, target);
            if (by_reply != NULL)
                Py_INCREF(by_reply);
            else if (PyErr_Occurred() || (by_reply = PyDict_New()) == NULL
                     || PyDict_SetItem(counts, target, by_reply) < 0) {
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
    Py_XDECREF(by_reply);
    Py_XDECREF(last_target);
    Py_DECREF(one);
    Py_RETURN_NONE;
fail:
    Py_XDECREF(by_reply);
    Py_XDECREF(last_target);
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
